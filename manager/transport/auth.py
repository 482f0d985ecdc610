"""Authentication of every RPC: a shared bearer token, optionally over TLS.

The token lives in a file (:func:`manager.common.wire.load_token`). Clients send it as gRPC
metadata ``authorization: Bearer <token>``; :class:`TokenInterceptor` rejects any call without it
(``UNAUTHENTICATED``) before a handler runs, comparing in constant time so the reply time does
not reveal how much of a guess was right. Without TLS the token crosses the network in clear
text: use ``--tls-cert``/``--tls-key`` whenever the manager is reachable from outside one host.

    >>> bearer_metadata("s3cret")
    (('authorization', 'Bearer s3cret'),)
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from manager.common.wire import MAX_RECONNECT_BACKOFF_S

__all__ = [
    "AUTH_HEADER",
    "TokenInterceptor",
    "bearer_metadata",
    "client_channel",
    "server_credentials",
]

AUTH_HEADER = "authorization"
_SCHEME = "Bearer "
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
