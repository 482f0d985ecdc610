"""The dashboard's HTTP server: one page, its script, plotly.js and two JSON endpoints, read-only.

aiohttp serves them from an asyncio loop in one thread that :class:`DashboardServer` owns:
``start()`` returns once the port is bound (or raises ``OSError`` with one line), ``stop()``
closes the connections, ends the loop and joins the thread. The handlers only read
(:class:`manager.dashboard.view.DashboardView`); every route is GET (HEAD too, as aiohttp adds
it), any other method is answered 405.

Note [Dashboard auth]: every request needs the manager's token, as every RPC does. A script
sends ``Authorization: Bearer <token>``; a browser opens ``/?token=<token>`` once, and the
answer is a redirect to the same page without the token in its address, setting an HttpOnly,
SameSite=Strict cookie. The cookie holds an HMAC of the token (never the token itself: a leaked
cookie reads the dashboard, it does not drive the manager's RPCs). Both are compared in constant
time (``hmac.compare_digest``); anything else is 401 before any handler runs. Answers forbid
framing and inline scripts (Content-Security-Policy) so a job name or event message, which users
choose, can never run as code; the page's script writes them as text only.

Note [Dashboard limits]: the dashboard shares the manager's process, so its descriptors are the
gRPC port's. A client without the token once opened 1,100 connections that sent half a request
and never finished it: the process ran out of descriptors, ``status`` and ``submit`` timed out and
asyncio logged ~25,000 lines a second (issue 35). So the server accepts connections itself
(``loop.sock_accept``, one at a time, handed to aiohttp with ``connect_accepted_socket``) and
holds at most ``DashboardLimits.max_connections`` (more are closed at once, one line a minute);
a connection that has not sent a whole request's headers within ``header_timeout_s`` of being
accepted is closed, as is one idle that long after an answer (aiohttp's keep-alive timeout), and
a body still arriving ``body_timeout_s`` after its headers (aiohttp's lingering time; every route
is GET and never reads one). A malformed request is answered 400 by aiohttp with one line a
minute in the log, never a traceback, and accept errors (a descriptor shortage) are one line a
minute too (Note [Rate-limited lines] in manager/common/log_lines.py). ``serve`` raises its soft
descriptor limit and sizes the cap so that gRPC keeps descriptors of its own
(``manager.common.descriptors``).

    >>> value = session_value("0123456789abcdef")
    >>> len(value), value == session_value("0123456789abcdef"), "0123456789abcdef" in value
    (64, True, False)
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import hmac
import json
import math
import socket
import ssl
import threading
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

from aiohttp import web

from manager.common.log_lines import RateLimitedLines
from manager.dashboard.view import DashboardView

__all__ = ["COOKIE", "DashboardLimits", "DashboardServer", "session_value"]

#: After an accept error (no descriptor left), wait this long before the next accept: the error
#: repeats at once otherwise, and a connection closing is what frees a descriptor.
ACCEPT_RETRY_S = 0.1


@dataclass(frozen=True, kw_only=True)
class DashboardLimits:
    """What one client may hold of the dashboard (Note [Dashboard limits])."""

    header_timeout_s: float = 10.0
    """A connection's first request must have sent all its headers this long after it was
    accepted (a TLS handshake included)."""
    body_timeout_s: float = 10.0
    """A request's body must have arrived this long after its headers."""
    idle_timeout_s: float = 10.0
    """A kept-alive connection with no new request (or half of one) is closed after this."""
    max_connections: int = 256
    """Connections held at once; more are closed as soon as they are accepted."""

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "idle_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"dashboard {name} must be a number > 0, got {value!r}")
        cap = self.max_connections
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ValueError(f"dashboard max_connections must be an integer >= 1, got {cap!r}")


COOKIE = "varuna_dashboard"
_HEADERS = {
    # plotly.js sets element styles at run time ('unsafe-inline' for styles only); no inline script.
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:;"
        " connect-src 'self'; font-src 'self' data:; frame-ancestors 'none'; base-uri 'none';"
        " form-action 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}
_UNAUTHORIZED = (
    "401: missing or wrong token: open /?token=<the manager's token> once, or send "
    "'Authorization: Bearer <token>'\n"
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def session_value(token: str) -> str:
    """The cookie's value for ``token`` (Note [Dashboard auth])."""
    return hmac.new(token.encode("utf-8"), b"varuna-dashboard-session", hashlib.sha256).hexdigest()


def _asset(name: str) -> bytes:
    return resources.files("manager.dashboard").joinpath(name).read_bytes()


class _Assets:
    """The page, its script and plotly.js (read once, on first use; plotly.js also gzipped)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._plotly: tuple[bytes, bytes] | None = None

    def plotly(self) -> tuple[bytes, bytes]:
        with self._lock:
            if self._plotly is None:
                from plotly.offline import get_plotlyjs

                raw = get_plotlyjs().encode("utf-8")
                self._plotly = (raw, gzip.compress(raw, 6))
            return self._plotly


class DashboardServer:
    """The read-only dashboard on ``host:port`` (port 0: any free one), in a thread of its own.

    Example::

        server = DashboardServer(DashboardView.from_manager(manager), token=token, host="127.0.0.1", port=0)
        server.start(); print(server.url); ...; server.stop()
    """

    def __init__(
        self,
        view: DashboardView,
        *,
        token: str,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None = None,
        limits: DashboardLimits | None = None,
        log: RateLimitedLines | None = None,
    ) -> None:
        self.view = view
        self.host, self.port = host, port
        self.limits = limits or DashboardLimits()
        self.log = log or RateLimitedLines()
        """Its lines (Note [Dashboard limits]): at most one a minute of each kind."""
        self._ssl = ssl_context
        self._bearer = f"Bearer {token}".encode()
        self._token = token.encode("utf-8")
        self._session = session_value(token).encode()
        self._assets = _Assets()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._listeners: list[socket.socket] = []
        self._accepting: list[asyncio.Task[None]] = []
        self._conns: dict[asyncio.BaseTransport, bool] = {}
        """Open connections -> whether a whole request came on it yet (the loop's thread only)."""
        self._connecting = 0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self._ssl else 'http'}://{host}:{self.port}/"

    # -- life cycle ----------------------------------------------------------------------------

    def start(self, timeout_s: float = 30.0) -> None:
        """Bind and serve; ``OSError`` (one line) when the address cannot be bound."""
        ready = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(
            target=self._run, args=(ready, failure), name="varuna-dashboard", daemon=True
        )
        self._thread.start()
        if not ready.wait(timeout_s):
            self.stop()
            raise OSError(f"the dashboard did not start within {timeout_s:g} s")
        if failure:
            self._thread.join(timeout_s)
            exc = failure[0]
            detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise OSError(
                f"cannot serve the dashboard on {self.host}:{self.port}: {detail};"
                " pick another --dashboard address"
            )

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close every connection, end the loop and join its thread (at most ``timeout_s``)."""
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(timeout_s)
        self._thread = None

    def _run(self, ready: threading.Event, failure: list[BaseException]) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            try:
                loop.run_until_complete(self._bind())
            except BaseException as exc:  # reported by start(); the loop still closes below
                failure.append(exc)
                loop.run_until_complete(self._close())
                return
            finally:
                ready.set()
            loop.run_forever()
            loop.run_until_complete(self._close())
        finally:
            loop.close()

    async def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(self._loop_error)
        app = web.Application(middlewares=[self._secure])
        app.add_routes(
            [
                web.get("/", self._page),
                web.get("/static/dashboard.js", self._script),
                web.get("/static/plotly.min.js", self._plotly),
                web.get("/api/jobs", self._jobs),
                web.get("/api/jobs/{job_id}", self._job),
            ]
        )
        limits = self.limits
        # A short shutdown: the page polls, so an open request is never worth waiting for.
        self._runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            shutdown_timeout=1.0,
            keepalive_timeout=limits.idle_timeout_s,
            lingering_time=limits.body_timeout_s,
            logger=_OneLineLogger(self.log),
        )
        await self._runner.setup()
        self._listeners = _listen(self.host, self.port)
        self.port = int(self._listeners[0].getsockname()[1])
        self._accepting = [loop.create_task(self._accept(sock)) for sock in self._listeners]

    async def _close(self) -> None:
        """Stop accepting, close every connection, free the port."""
        for task in self._accepting:
            task.cancel()
        for task in self._accepting:
            try:
                await task
            except asyncio.CancelledError:
                pass
        for sock in self._listeners:
            sock.close()
        if self._runner is not None:
            await self._runner.cleanup()
        for transport in list(self._conns):  # a TLS handshake still under way
            transport.abort()
        self._conns.clear()

    # -- connections (Note [Dashboard limits]) -------------------------------------------------

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as exc:  # EMFILE and friends: the next accept would fail the same way
                self.log.line(
                    ("accept", exc.errno),
                    f"varuna-manager: dashboard: cannot accept a connection ({exc.strerror or exc});"
                    " retrying",
                )
                await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            if self._open_connections() >= self.limits.max_connections:
                conn.close()
                self.log.line(
                    "full",
                    f"varuna-manager: dashboard: {self.limits.max_connections} connections open;"
                    " closing new ones until some end",
                )
                continue
            self._connecting += 1
            loop.create_task(self._serve(conn))

    async def _serve(self, conn: socket.socket) -> None:
        """Hand an accepted connection to aiohttp, with its header deadline."""
        loop = asyncio.get_running_loop()
        assert self._runner is not None and self._runner.server is not None
        limits = self.limits
        try:
            conn.setblocking(False)
            transport, _ = await loop.connect_accepted_socket(
                self._runner.server,
                conn,
                ssl=self._ssl,
                ssl_handshake_timeout=limits.header_timeout_s if self._ssl else None,
            )
        except (OSError, asyncio.TimeoutError, ssl.SSLError) as exc:
            conn.close()
            why = f"varuna-manager: dashboard: connection dropped: {exc}".splitlines()[0]
            self.log.line("handshake", why)
            return
        finally:
            self._connecting -= 1
        self._conns[transport] = False
        loop.call_later(limits.header_timeout_s, self._header_deadline, transport)

    def _header_deadline(self, transport: asyncio.BaseTransport) -> None:
        """The first request's headers did not come in time: close (a request on the way is
        answered first: aiohttp closes once it is done)."""
        served = self._conns.pop(transport, True)
        if not served and not transport.is_closing():
            transport.close()

    def _open_connections(self) -> int:
        for transport in [t for t in self._conns if t.is_closing()]:
            del self._conns[transport]
        return len(self._conns) + self._connecting

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """asyncio's own error reports (a transport's fatal error...): one line a minute each."""
        exc = context.get("exception")
        what = f"{context.get('message', 'error')}" + (f": {type(exc).__name__}: {exc}" if exc else "")
        self.log.line(("loop", context.get("message")), f"varuna-manager: dashboard: {what}".splitlines()[0])

    # -- auth and headers ----------------------------------------------------------------------

    @web.middleware
    async def _secure(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Note [Dashboard auth]: 401 unless the token or the session cookie is right; then the
        route (405 for a method other than GET); security headers on every answer."""
        if request.transport is not None and request.transport in self._conns:
            self._conns[request.transport] = True  # headers complete: aiohttp's timeouts from here
        given = request.query.get("token")
        if request.method == "GET" and given is not None:
            if not hmac.compare_digest(given.encode("utf-8"), self._token):
                return self._headers(web.Response(status=401, text=_UNAUTHORIZED))
            # Drop the token from the address (history, screen sharing) once the cookie is set.
            response = web.Response(status=303, headers={"Location": request.path})
            response.set_cookie(
                COOKIE,
                self._session.decode(),
                httponly=True,
                samesite="Strict",
                secure=self._ssl is not None,
                path="/",
            )
            return self._headers(response)
        if not self._authorized(request):
            return self._headers(web.Response(status=401, text=_UNAUTHORIZED))
        try:
            response = await handler(request)
        except web.HTTPException as exc:  # 404, 405: answered with the same headers
            response = web.Response(status=exc.status, text=exc.text, headers=exc.headers)
        return self._headers(response)

    def _authorized(self, request: web.Request) -> bool:
        header = request.headers.get("Authorization", "").encode("utf-8")
        cookie = request.cookies.get(COOKIE, "").encode("utf-8")
        # Both compared, always: the time does not tell which one was sent.
        by_header = hmac.compare_digest(header, self._bearer)
        by_cookie = hmac.compare_digest(cookie, self._session)
        return by_header or by_cookie

    @staticmethod
    def _headers(response: web.StreamResponse) -> web.StreamResponse:
        response.headers.update(_HEADERS)
        response.headers.setdefault("Cache-Control", "no-store")
        return response

    # -- routes --------------------------------------------------------------------------------

    async def _page(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=_asset("page.html"), content_type="text/html", charset="utf-8")

    async def _script(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=_asset("dashboard.js"), content_type="text/javascript", charset="utf-8")

    async def _plotly(self, request: web.Request) -> web.StreamResponse:
        raw, packed = self._assets.plotly()
        headers = {"Cache-Control": "private, max-age=86400"}
        if "gzip" in request.headers.get("Accept-Encoding", ""):
            headers["Content-Encoding"] = "gzip"
            return web.Response(body=packed, content_type="text/javascript", charset="utf-8", headers=headers)
        return web.Response(body=raw, content_type="text/javascript", charset="utf-8", headers=headers)

    async def _jobs(self, request: web.Request) -> web.StreamResponse:
        return _json({"jobs": self.view.jobs()})

    async def _job(self, request: web.Request) -> web.StreamResponse:
        job = self.view.job(request.match_info["job_id"])
        if job is None:
            return _json({"error": f"no job {request.match_info['job_id']!r}"}, status=404)
        return _json(job)


def _finite(data: Any) -> Any:
    """``data`` with NaN and infinities (a diverged loss) as None: JSON has no such numbers, and
    the charts leave a gap at a null."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite(v) for v in data]
    return data


def _json(data: Any, status: int = 200) -> web.Response:
    text = json.dumps(_finite(data), allow_nan=False)
    return web.Response(text=text, status=status, content_type="application/json")


def _listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on every address of ``host`` (``port`` 0: a free one, the same on all),
    non-blocking. ``OSError`` when one cannot be bound."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    out: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):  # each address once
            sock = socket.socket(family, kind, proto)
            out.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if out[:-1] and address[1] == 0:  # port 0: the first socket's port for the others
                address = (address[0], out[0].getsockname()[1], *address[2:])
            sock.bind(address)
            sock.listen(128)
            sock.setblocking(False)
    except BaseException:
        for sock in out:
            sock.close()
        raise
    return out


class _OneLineLogger:
    """What aiohttp's request handler logs through (its ``logger``): a malformed request or a
    failed handler is one rate-limited line, not a traceback (Note [Dashboard limits]); a
    handler's own exception (a bug) keeps its traceback, once a minute."""

    def __init__(self, log: RateLimitedLines) -> None:
        self._log = log

    def debug(self, *args: Any, **kw: Any) -> None:
        pass

    info = debug

    def isEnabledFor(self, level: int) -> bool:  # noqa: N802 (logging.Logger's name)
        return level >= 30

    def warning(self, msg: str, *args: Any, exc_info: Any = None, **kw: Any) -> None:
        self._line(msg, args, exc_info)

    error = warning

    def exception(self, msg: str, *args: Any, exc_info: Any = True, **kw: Any) -> None:
        self._line(msg, args, exc_info)

    def _line(self, msg: str, args: tuple[Any, ...], exc_info: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else None
        text = (msg % args) if args else str(msg)
        status = getattr(exc, "status", None) or getattr(exc, "code", None)
        detail = f": {type(exc).__name__}: {getattr(exc, 'message', None) or exc}" if exc is not None else ""
        key = (type(exc).__name__ if exc is not None else msg, status)
        written = self._log.line(key, f"varuna-manager: dashboard: {text}{detail}".splitlines()[0])
        if written and exc is not None and status is None and not isinstance(exc, (OSError, ValueError)):
            traceback.print_exception(exc)  # a bug in a handler: its traceback, once a minute
