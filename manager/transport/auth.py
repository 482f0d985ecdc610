"""Authentication of every RPC: a shared bearer token, optionally over TLS.

The token lives in a file (never on a command line or in an environment variable, where ``ps``
and ``/proc/*/environ`` show it). Clients send it as gRPC metadata ``authorization: Bearer
<token>``; :class:`TokenInterceptor` rejects any call without it (``UNAUTHENTICATED``) before a
handler runs, comparing in constant time so the reply time does not reveal how much of a guess
was right. Without TLS the token crosses the network in clear text: use ``--tls-cert``/
``--tls-key`` whenever the manager is reachable from outside one host.

    >>> bearer_metadata("s3cret")
    (('authorization', 'Bearer s3cret'),)
"""

from __future__ import annotations

import hmac
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

__all__ = [
    "AUTH_HEADER",
    "TokenInterceptor",
    "bearer_metadata",
    "client_channel",
    "load_token",
    "server_credentials",
]

AUTH_HEADER = "authorization"
_SCHEME = "Bearer "
#: A token shorter than this is too easy to guess; ``secrets.token_urlsafe(32)`` gives 43 chars.
MIN_TOKEN_CHARS = 16


def load_token(path: str | os.PathLike) -> str:
    """The token in ``path`` (surrounding whitespace stripped). ``ValueError`` with one line when
    the file is missing, empty, too short, or readable by other users."""
    p = Path(path)
    try:
        st = p.stat()
        text = p.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ValueError(f"cannot read token file {p}: {exc.strerror or exc}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"token file {p} is accessible by other users; run: chmod 600 {p}")
    if not text:
        raise ValueError(
            f"token file {p} is empty; write a random token, e.g. "
            "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )
    if len(text) < MIN_TOKEN_CHARS or any(c.isspace() for c in text):
        raise ValueError(f"token in {p} must be at least {MIN_TOKEN_CHARS} characters without whitespace")
    return text


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that authenticates a client (added to every call; per-call metadata
    works on insecure channels, where gRPC refuses call credentials)."""
    return ((AUTH_HEADER, _SCHEME + token),)


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every RPC whose ``authorization`` metadata is not ``Bearer <token>``."""

    def __init__(self, token: str) -> None:
        self._expected = (_SCHEME + token).encode("utf-8")

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        presented = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTH_HEADER:
                presented = value.encode("utf-8") if isinstance(value, str) else bytes(value)
                break
        # compare_digest: constant time in the contents (it leaks only the length).
        if hmac.compare_digest(presented, self._expected):
            return continuation(handler_call_details)
        return _DENY


def _deny(request: Any, context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token (authorization: Bearer <token>)")


# Every service method is unary-unary, so one denying handler fits all of them; the request is
# never deserialised (no parsing of unauthenticated input).
_DENY = grpc.unary_unary_rpc_method_handler(_deny)


def server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials:
    """TLS credentials for the server from PEM files; ``ValueError`` if unreadable."""
    try:
        cert = Path(cert_file).read_bytes()
        key = Path(key_file).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read TLS certificate/key: {exc.filename}: {exc.strerror}") from None
    return grpc.ssl_server_credentials([(key, cert)])


#: The longest a client waits between two connection attempts to a manager that is down; gRPC adds
#: up to 20 % jitter. A restarted manager allows this much before it counts silence (Note
#: [Restart grace] in manager/domain/context.py).
MAX_RECONNECT_BACKOFF_S = 1.0


def client_channel(address: str, *, tls_ca: str | None = None, tls: bool = False) -> grpc.Channel:
    """A channel to the manager: TLS when ``tls_ca`` (PEM of the CA or the self-signed cert) is
    given or ``tls`` is set (system roots), plain otherwise."""
    options = [
        # Heartbeats are small; fail fast rather than queue calls for a manager that is down.
        ("grpc.enable_retries", 0),
        ("grpc.max_receive_message_length", 64 << 20),
        # A restarted manager must hear from every agent and worker within a second or two; the
        # default reconnect back-off grows to 2 minutes. (Not grpc.min_reconnect_backoff_ms: it
        # is also the deadline of one connection attempt, which a loaded manager needs.)
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", int(MAX_RECONNECT_BACKOFF_S * 1000)),
    ]
    if tls_ca or tls:
        root = None
        if tls_ca:
            try:
                root = Path(tls_ca).read_bytes()
            except OSError as exc:
                raise ValueError(f"cannot read TLS CA file {tls_ca}: {exc.strerror}") from None
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=root), options)
    return grpc.insecure_channel(address, options)
