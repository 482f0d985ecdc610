"""HTTP to a VM's metadata service, as the agent's notice sources need it: link-local, no proxy, a
short timeout, and an endpoint that fails reported once and retried with back-off.

The AWS (:mod:`manager.agent.aws_imds`) and GCP (:mod:`manager.agent.gcp_metadata`) notice
sources reach their metadata service through one :class:`MetadataEndpoint`. Their ``poll()``
runs about once a second in the agent's notice thread and must never raise or block for long
(:class:`manager.agent.notices.NoticeSource`).

Note [Metadata back-off]: a metadata endpoint that cannot be read (a wrong ``--notice-url``, a
VM whose metadata service is disabled or firewalled, a document that is not what the platform
documents) is no notice, and the agent goes on without one. It is said in one line on the
agent's stderr (its log) when the first failure of a run of failures happens, never again while
the failures go on, and once more ("answers again") when the endpoint recovers. Meanwhile the
source asks again after 1, 2, 4, 8 s, then every ``max_backoff_s`` (10), not at every poll: a
broken endpoint costs neither a log line nor a request per second, and one that recovers is heard
again within 10 s (GCP's notice is 30 s, AWS's two minutes).

    >>> clock = iter([0.0, 0.0, 0.5, 1.0]).__next__
    >>> said = []
    >>> ep = MetadataEndpoint("demo", clock=clock, say=said.append)
    >>> ep.ready(), ep.failed("connection refused"), ep.ready(), ep.ready()
    (True, None, False, True)
    >>> said[0].split("; ")  # doctest: +ELLIPSIS
    ['notice source demo: connection refused', 'no notice can be seen until it answers (retrying ...)']
"""

from __future__ import annotations

import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = ["MetadataEndpoint", "MetadataError", "Response"]


class MetadataError(Exception):
    """The endpoint answered something the platform does not document (one line: why)."""


@dataclass(frozen=True)
class Response:
    """One HTTP answer: status, headers (case-insensitive lookup with :meth:`header`), body."""

    status: int
    headers: Mapping[str, str]
    body: bytes

    def header(self, name: str) -> str:
        lower = name.lower()
        return next((v for k, v in self.headers.items() if k.lower() == lower), "")

    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


def _stderr(line: str) -> None:
    stamp = time.strftime("%H:%M:%S")
    print(f"{stamp} varuna-vm-agent: {line}", file=sys.stderr, flush=True)


class MetadataEndpoint:
    """Requests to one metadata service and the back-off state of its failures (Note [Metadata
    back-off]). ``say`` gets each one-line report (default: the agent's stderr)."""

    def __init__(
        self,
        what: str,
        *,
        timeout_s: float = 2.0,
        min_backoff_s: float = 1.0,
        max_backoff_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        say: Callable[[str], None] = _stderr,
    ) -> None:
        self.what = what
        self.timeout_s = timeout_s
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._say = say
        self._next_try = 0.0
        self._backoff = 0.0  # 0: not failing
        self.failures = 0
        """Failures in the current run of failures (0: the endpoint answers)."""
        # The metadata address is link-local: an HTTP proxy must never see these requests.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def request(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        *,
        timeout_s: float | None = None,
    ) -> Response:
        """One request; any HTTP status comes back as a :class:`Response` (``OSError`` when the
        endpoint cannot be reached or times out)."""
        data = b"" if method == "PUT" else None
        req = urllib.request.Request(url, method=method, headers=dict(headers), data=data)
        try:
            with self._opener.open(req, timeout=timeout_s or self.timeout_s) as resp:
                return Response(resp.status, dict(resp.headers.items()), resp.read())
        except urllib.error.HTTPError as exc:
            with exc:
                return Response(exc.code, dict(exc.headers.items()) if exc.headers else {}, exc.read())

    def ready(self) -> bool:
        """Whether a request is due (False while backing off after a failure)."""
        return self._clock() >= self._next_try

    def failed(self, why: str) -> None:
        """A failed request: one line for the first failure of a run, then back off."""
        if self.failures == 0:
            self._say(
                f"notice source {self.what}: {why}; no notice can be seen until it answers "
                "(retrying with back-off)"
            )
        self.failures += 1
        self._backoff = min(self.max_backoff_s, max(self.min_backoff_s, self._backoff * 2))
        self._next_try = self._clock() + self._backoff

    def succeeded(self) -> None:
        """A request that worked: the end of a run of failures is said once."""
        if self.failures:
            self._say(f"notice source {self.what}: answers again after {self.failures} failed request(s)")
        self.failures = 0
        self._backoff = 0.0
        self._next_try = 0.0
