"""Local stand-ins for two clouds' metadata services, as the notice sources and the aws provider's
user data talk to them (real HTTP on loopback; the documents are the ones the clouds document).

:class:`FakeIMDS` plays AWS's instance metadata service, version 2, for any number of instances:
instance ``i`` is at ``{url}/{i}`` (a real instance has IMDS at ``http://169.254.169.254``; the
agent and the user data take the base address as a parameter). It issues session tokens (``PUT
/latest/api/token`` with the TTL header, else 400), refuses a GET without a valid token (401),
and serves ``instance-id``, ``ami-launch-index`` and ``spot/instance-action`` (404 until armed).

:class:`FakeGCPMetadata` plays Compute Engine's metadata server for one VM:
``/computeMetadata/v1/instance/preempted`` (``FALSE`` until preempted), which needs the
``Metadata-Flavor: Google`` header (403 without, as GCP answers), sends it back with an ETag, and
honours ``wait_for_change=true&last_etag=...&timeout_sec=N``.

Both count the requests they answer and can be broken on purpose (``broken``: every answer is
that status, or a body that is not the documented one).
"""

from __future__ import annotations

import hashlib
import http.server
import json
import secrets
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

#: AWS's documented example of an interruption notice (EC2 User Guide, "Spot Instance interruption
#: notices"), and its other actions.
INSTANCE_ACTION_TERMINATE = {"action": "terminate", "time": "2017-09-18T08:22:00Z"}
INSTANCE_ACTION_STOP = {"action": "stop", "time": "2017-09-18T08:22:00Z"}
INSTANCE_ACTION_HIBERNATE = {"action": "hibernate", "time": "2017-09-18T08:22:00Z"}


class _Server:
    """A ThreadingHTTPServer on loopback with a handler class bound to ``self``."""

    def __init__(self, handler: type[http.server.BaseHTTPRequestHandler]) -> None:
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,),
                                        name=type(self).__name__, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(10)


def _reply(handler: http.server.BaseHTTPRequestHandler, status: int, body: bytes | str = b"",
           headers: dict[str, str] | None = None) -> None:
    data = body.encode() if isinstance(body, str) else body
    try:
        handler.send_response(status)
        for k, v in (headers or {}).items():
            handler.send_header(k, v)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the client gave up waiting (its timeout): what a real server sees too


@dataclass
class Instance:
    """What IMDS knows of one instance."""

    instance_id: str
    launch_index: int = 0
    action: dict | None = None
    """The ``spot/instance-action`` document, None: 404."""
    tokens: dict[str, float] = field(default_factory=dict)
    """Session token → expiry (monotonic)."""


class FakeIMDS(_Server):
    """AWS IMDSv2 for several instances (module docstring). ``lookup(instance_id)`` gives an
    instance's launch index when IMDS first hears of it (tests: from the EC2 API)."""

    def __init__(self, lookup: Callable[[str], int] | None = None) -> None:
        self.instances: dict[str, Instance] = {}
        self.lookup = lookup
        self.requests: Counter = Counter()
        self.broken: int | str | None = None
        """An HTTP status every request gets, or a body every instance-action GET gets."""
        self._lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_PUT(self) -> None:  # noqa: N802 (http.server's naming)
                outer._put(self)

            def do_GET(self) -> None:  # noqa: N802
                outer._get(self)

            def log_message(self, *args) -> None:
                pass

        super().__init__(Handler)

    def base(self, instance_id: str) -> str:
        """IMDS's base address for ``instance_id`` (``http://169.254.169.254`` on EC2)."""
        return f"{self.url}/{instance_id}"

    def instance(self, instance_id: str) -> Instance:
        with self._lock:
            known = self.instances.get(instance_id)
        if known is not None:
            return known
        index = self.lookup(instance_id) if self.lookup else 0  # not under the lock: may be slow
        with self._lock:
            return self.instances.setdefault(instance_id, Instance(instance_id, launch_index=index))

    def interrupt(self, instance_id: str, doc: dict | None = None) -> None:
        """Arm ``spot/instance-action`` for the instance (AWS's example document by default)."""
        self.instance(instance_id).action = dict(doc or INSTANCE_ACTION_TERMINATE)

    def expire_tokens(self) -> None:
        """Every token issued so far becomes invalid (the next GET with one is a 401)."""
        with self._lock:
            for inst in self.instances.values():
                inst.tokens.clear()

    def _split(self, handler) -> tuple[Instance, str]:
        path = urllib.parse.urlsplit(handler.path).path
        _, instance_id, rest = path.split("/", 2)
        return self.instance(instance_id), "/" + rest

    def _put(self, h) -> None:
        inst, path = self._split(h)
        self.requests["PUT " + path] += 1
        if isinstance(self.broken, int):
            return _reply(h, self.broken)
        ttl = h.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
        if path != "/latest/api/token":
            return _reply(h, 404)
        if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
            return _reply(h, 400, "Missing or Invalid Parameters")
        token = secrets.token_urlsafe(24)
        with self._lock:
            inst.tokens[token] = time.monotonic() + int(ttl)
        _reply(h, 200, token, {"X-aws-ec2-metadata-token-ttl-seconds": ttl})

    def _get(self, h) -> None:
        inst, path = self._split(h)
        self.requests["GET " + path] += 1
        if isinstance(self.broken, int):
            return _reply(h, self.broken)
        token = h.headers.get("X-aws-ec2-metadata-token", "")
        with self._lock:
            valid = inst.tokens.get(token, 0.0) > time.monotonic()
        if not valid:
            return _reply(h, 401)
        item = path.removeprefix("/latest/meta-data/")
        if item == "instance-id":
            return _reply(h, 200, inst.instance_id)
        if item == "ami-launch-index":
            return _reply(h, 200, str(inst.launch_index))
        if item == "spot/instance-action":
            if isinstance(self.broken, str):
                return _reply(h, 200, self.broken)
            if inst.action is None:
                return _reply(h, 404)
            return _reply(h, 200, json.dumps(inst.action), {"Content-Type": "text/plain"})
        _reply(h, 404)


class FakeGCPMetadata(_Server):
    """Compute Engine's metadata server for one VM (module docstring)."""

    PATH = "/computeMetadata/v1/instance/preempted"

    def __init__(self) -> None:
        self.preempted = False
        self.requests: list[dict[str, str]] = []
        """The query of every request answered (``wait_for_change``, ``last_etag``...)."""
        self.broken: int | str | None = None
        self.flavor_header = True
        """Whether answers carry ``Metadata-Flavor: Google`` (False: a server that is not GCP's)."""
        self._changed = threading.Condition()
        self._closing = False
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                outer._get(self)

            def log_message(self, *args) -> None:
                pass

        super().__init__(Handler)

    def close(self) -> None:
        with self._changed:  # a long poll still waiting answers now
            self._closing = True
            self._changed.notify_all()
        super().close()

    def preempt(self) -> None:
        with self._changed:
            self.preempted = True
            self._changed.notify_all()

    def _value(self) -> str:
        return "TRUE" if self.preempted else "FALSE"

    @staticmethod
    def _etag(value: str) -> str:
        return hashlib.sha1(value.encode()).hexdigest()[:16]

    def _get(self, h) -> None:
        split = urllib.parse.urlsplit(h.path)
        query = dict(urllib.parse.parse_qsl(split.query))
        self.requests.append(query)
        if h.headers.get("Metadata-Flavor") != "Google":
            return _reply(h, 403, "Missing Metadata-Flavor:Google header.")
        if isinstance(self.broken, int):
            return _reply(h, self.broken)
        if split.path != self.PATH:
            return _reply(h, 404)
        if query.get("wait_for_change") == "true":
            timeout = min(float(query.get("timeout_sec", "300")), 300.0)
            last = query.get("last_etag", "")
            with self._changed:
                self._changed.wait_for(lambda: self._closing or self._etag(self._value()) != last, timeout)
        value = self._value()
        body = self.broken if isinstance(self.broken, str) else value
        headers = {"ETag": self._etag(value), "Content-Type": "application/text"}
        if self.flavor_header:
            headers["Metadata-Flavor"] = "Google"
        _reply(h, 200, body, headers)
