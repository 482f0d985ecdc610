"""AWS EC2 spot interruption notices: the two-minute warning in the instance metadata service.

On a spot instance that EC2 is about to interrupt, IMDS (instance metadata service, version 2:
session tokens) answers::

    PUT http://169.254.169.254/latest/api/token
        X-aws-ec2-metadata-token-ttl-seconds: 21600          -> 200, the token (text)
    GET http://169.254.169.254/latest/meta-data/spot/instance-action
        X-aws-ec2-metadata-token: <token>
        -> 404 while no interruption is scheduled
        -> 200 {"action": "terminate", "time": "2017-09-18T08:22:00Z"}   ("stop", "hibernate")
        -> 401 when the token expired or is not valid: get a new one

The item appears about two minutes before ``time``; every action ends the VM for the job (a
stopped or hibernated instance runs no agent), so each is a notice. EC2 has no step to approve:
:meth:`InstanceActionClient.approve` is False (the agent only approves with
``--approve-notices``, which the aws provider does not pass).

This is the notice source the aws provider declares (``manager.providers.aws``). ``--notice-url``
is IMDS's base address (default ``http://169.254.169.254``), so tests point it at a local HTTP
server that plays IMDS. The token is kept for its TTL (less a minute) and renewed on a 401; an
endpoint that cannot be read, or answers what AWS does not document, is no notice: one line,
then back-off (Note [Metadata back-off] in :mod:`manager.agent.metadata_http`).

    >>> parse_instance_action('{"action": "terminate", "time": "2017-09-18T08:22:00Z"}').event_type
    'spot-terminate'
    >>> parse_instance_action('{"action": "reboot"}')  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    manager.agent.metadata_http.MetadataError: spot/instance-action is not {"action": ...
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from manager.agent.metadata_http import MetadataEndpoint, MetadataError
from manager.agent.notices import Notice

__all__ = ["ACTIONS", "DEFAULT_IMDS_URL", "InstanceActionClient", "parse_instance_action"]

DEFAULT_IMDS_URL = "http://169.254.169.254"
TOKEN_PATH = "/latest/api/token"
ACTION_PATH = "/latest/meta-data/spot/instance-action"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
#: What EC2 may do to an interrupted spot instance; each one ends the VM for the job.
ACTIONS = ("terminate", "stop", "hibernate")


def parse_instance_action(body: str) -> Notice:
    """The notice in a ``spot/instance-action`` document; :class:`MetadataError` when it is not
    one (one line quoting the start of the body)."""
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    bad = not isinstance(doc, dict) or doc.get("action") not in ACTIONS
    if bad or not isinstance(doc.get("time", ""), str):
        raise MetadataError(
            f'spot/instance-action is not {{"action": terminate|stop|hibernate, "time": ...}}: {body[:80]!r}'
        )
    action, when = doc["action"], doc.get("time", "")
    return Notice(
        event_id=f"instance-action-{action}-{when}",
        event_type=f"spot-{action}",
        not_before=when,
        description=f"EC2 spot interruption: {action} at {when or 'an unstated time'}",
    )


class InstanceActionClient:
    """Polls this instance's ``spot/instance-action`` with an IMDSv2 token (a
    :class:`~manager.agent.notices.NoticeSource`; ``url`` None: IMDS's own address). ``vm_name``
    is not needed: the metadata service only speaks of its own instance."""

    def __init__(
        self,
        url: str | None,
        vm_name: str,
        *,
        timeout_s: float = 2.0,
        token_ttl_s: int = 21600,
        clock: Callable[[], float] = time.monotonic,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.url = (url or DEFAULT_IMDS_URL).rstrip("/")
        self.vm_name = vm_name
        self.token_ttl_s = token_ttl_s
        self._clock = clock
        extra = {"say": say} if say is not None else {}
        self.endpoint = MetadataEndpoint(f"AWS IMDS at {self.url}", timeout_s=timeout_s, clock=clock,
                                         **extra)
        self._token = ""
        self._token_until = 0.0
        self._notice: Notice | None = None
        self.token_requests = 0
        """Tokens asked for so far (tests check the refresh)."""

    def _session_token(self) -> str:
        if self._token and self._clock() < self._token_until:
            return self._token
        self.token_requests += 1
        resp = self.endpoint.request("PUT", self.url + TOKEN_PATH, {TTL_HEADER: str(self.token_ttl_s)})
        token = resp.text().strip()
        if resp.status != 200 or not token:
            raise MetadataError(
                f"PUT {TOKEN_PATH} answered HTTP {resp.status} (is IMDS enabled on this instance?)"
            )
        self._token = token
        self._token_until = self._clock() + max(1.0, self.token_ttl_s - 60.0)  # renew a minute early
        return token

    def fetch(self) -> Notice | None:
        """The notice now (None: no interruption scheduled); ``OSError`` or
        :class:`MetadataError` when IMDS cannot be read."""
        for attempt in (1, 2):
            resp = self.endpoint.request("GET", self.url + ACTION_PATH, {TOKEN_HEADER: self._session_token()})
            if resp.status == 401 and attempt == 1:  # expired or unknown token: one fresh one
                self._token = ""
                continue
            if resp.status == 404:
                return None
            if resp.status != 200:
                raise MetadataError(f"GET {ACTION_PATH} answered HTTP {resp.status}")
            return parse_instance_action(resp.text())
        raise AssertionError("unreachable")  # pragma: no cover

    def poll(self) -> list[Notice]:
        """This instance's notice now (empty when there is none or IMDS cannot be read)."""
        if self._notice is not None:  # an interruption is never called off
            return [self._notice]
        if not self.endpoint.ready():
            return []
        try:
            notice = self.fetch()
        except (OSError, MetadataError) as exc:
            self.endpoint.failed(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return []
        self.endpoint.succeeded()
        if notice is None:
            return []
        self._notice = notice
        return [notice]

    def approve(self, event_id: str) -> bool:
        """EC2 has no step to approve an interruption: always False."""
        return False
