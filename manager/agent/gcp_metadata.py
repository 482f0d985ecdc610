"""GCP preemption notices: ``instance/preempted`` in the Compute Engine metadata server.

A Spot or preemptible Compute Engine VM learns that it is being preempted about 30 s before it
stops (an ACPI soft off) from its metadata server::

    GET http://metadata.google.internal/computeMetadata/v1/instance/preempted
        Metadata-Flavor: Google
        -> 200 "FALSE" (or "TRUE" once preempted), response header Metadata-Flavor: Google, ETag

    GET ...instance/preempted?wait_for_change=true&last_etag=<ETag>&timeout_sec=5
        -> answers as soon as the value differs from the one with that ETag, else after 5 s

This source long-polls (``wait_for_change``, bounded by ``wait_s``: the agent's notice thread
gets its answer within ``wait_s`` + the timeout) so a preemption is seen the moment it is set,
with about one request per ``wait_s`` instead of one a second. An answer without the
``Metadata-Flavor: Google`` header is not from the metadata server (a proxy, a wrong
``--notice-url``) and is refused. A failed or unreadable answer is no notice: one line, then
back-off (Note [Metadata back-off] in :mod:`manager.agent.metadata_http`). GCP has no step to
approve a preemption: :meth:`PreemptedClient.approve` is False.

No GCP *provider* ships with varuna; this source serves agents on Compute Engine VMs (GKE Spot
nodes are such VMs) and the local provider's pretend VMs (``provider_options.notice_source``,
docs/manager.md). ``--notice-url`` is the metadata server's base address (default
``http://metadata.google.internal``); tests serve recorded answers from a local HTTP server.

    >>> parse_preempted("TRUE"), parse_preempted("FALSE")
    (True, False)
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

from manager.agent.metadata_http import MetadataEndpoint, MetadataError, Response
from manager.agent.notices import Notice

__all__ = ["DEFAULT_METADATA_URL", "PreemptedClient", "parse_preempted"]

DEFAULT_METADATA_URL = "http://metadata.google.internal"
PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
FLAVOR = ("Metadata-Flavor", "Google")
#: How long a preempted VM has, per Google's documentation (Compute Engine, "Preemption process").
NOTICE_S = 30.0


def parse_preempted(body: str) -> bool:
    """``TRUE``/``FALSE`` as the metadata server writes them; :class:`MetadataError` otherwise."""
    value = body.strip()
    if value not in ("TRUE", "FALSE"):
        raise MetadataError(f"instance/preempted is not TRUE or FALSE: {value[:40]!r}")
    return value == "TRUE"


class PreemptedClient:
    """Polls ``instance/preempted`` (a :class:`~manager.agent.notices.NoticeSource`; ``url``
    None: the metadata server's own address). ``vm_name``: unused, the server speaks of its VM."""

    def __init__(
        self,
        url: str | None,
        vm_name: str,
        *,
        timeout_s: float = 2.0,
        wait_s: int = 5,
        clock: Callable[[], float] = time.monotonic,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.url = (url or DEFAULT_METADATA_URL).rstrip("/")
        self.vm_name = vm_name
        self.wait_s = int(wait_s)
        self.timeout_s = timeout_s
        extra = {"say": say} if say is not None else {}
        self.endpoint = MetadataEndpoint(
            f"GCP metadata at {self.url}", timeout_s=timeout_s, clock=clock, **extra
        )
        self._etag = ""
        self._notice: Notice | None = None

    def _get(self) -> Response:
        url = self.url + PREEMPTED_PATH
        timeout = self.timeout_s
        if self._etag and self.wait_s > 0:  # the value is known: wait for it to change
            query = {"wait_for_change": "true", "last_etag": self._etag, "timeout_sec": str(self.wait_s)}
            url += "?" + urllib.parse.urlencode(query)
            timeout += self.wait_s
        return self.endpoint.request("GET", url, dict([FLAVOR]), timeout_s=timeout)

    def fetch(self) -> bool:
        """Whether this VM is preempted now; ``OSError`` or :class:`MetadataError` when the
        metadata server cannot be read."""
        resp = self._get()
        if resp.status != 200:
            raise MetadataError(f"GET {PREEMPTED_PATH} answered HTTP {resp.status}")
        if resp.header(FLAVOR[0]) != FLAVOR[1]:
            raise MetadataError(
                f"the answer has no '{FLAVOR[0]}: {FLAVOR[1]}' header: not a GCP metadata server"
            )
        preempted = parse_preempted(resp.text())
        self._etag = resp.header("ETag")
        return preempted

    def poll(self) -> list[Notice]:
        """This VM's notice now (empty when it is not preempted or the server cannot be read)."""
        if self._notice is not None:  # a preemption is never called off
            return [self._notice]
        if not self.endpoint.ready():
            return []
        try:
            preempted = self.fetch()
        except (OSError, MetadataError) as exc:
            self._etag = ""  # ask plainly next time: the failure may have been the long poll
            self.endpoint.failed(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return []
        self.endpoint.succeeded()
        if not preempted:
            return []
        seen = datetime.now(timezone.utc)
        self._notice = Notice(
            event_id=f"gce-preempted-{seen:%Y%m%dT%H%M%SZ}",
            event_type="Preempt",
            not_before=(seen + timedelta(seconds=NOTICE_S)).strftime("%Y-%m-%dT%H:%M:%SZ"),
            description=f"Compute Engine preempted this VM; it stops about {NOTICE_S:g} s after the notice "
            "(not_before is that estimate)",
        )
        return [self._notice]

    def approve(self, event_id: str) -> bool:
        """Compute Engine has no step to approve a preemption: always False."""
        return False
