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
import ssl
import threading
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from aiohttp import web

from manager.dashboard.view import DashboardView

__all__ = ["COOKIE", "DashboardServer", "session_value"]

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
    ) -> None:
        self.view = view
        self.host, self.port = host, port
        self._ssl = ssl_context
        self._bearer = f"Bearer {token}".encode()
        self._token = token.encode("utf-8")
        self._session = session_value(token).encode()
        self._assets = _Assets()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

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
                if self._runner is not None:
                    loop.run_until_complete(self._runner.cleanup())
                return
            finally:
                ready.set()
            loop.run_forever()
            assert self._runner is not None
            loop.run_until_complete(self._runner.cleanup())
        finally:
            loop.close()

    async def _bind(self) -> None:
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
        # A short shutdown: the page polls, so an open request is never worth waiting for.
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=self._ssl, reuse_address=True)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    # -- auth and headers ----------------------------------------------------------------------

    @web.middleware
    async def _secure(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Note [Dashboard auth]: 401 unless the token or the session cookie is right; then the
        route (405 for a method other than GET); security headers on every answer."""
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
