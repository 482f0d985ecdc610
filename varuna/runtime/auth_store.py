"""An authenticated key-value store for a live run's rendezvous (Note [Store authentication]):
:class:`AuthStoreServer`, hosted by the launcher or the manager, and :class:`AuthStore`, the
workers' client -- a ``torch.distributed.Store``, so gloo groups (through ``PrefixStore``)
rendezvous on it like on a ``TCPStore``.

Note [Store authentication]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
``torch.distributed.TCPStore`` has no authentication: any process that can reach its port (``ss
-ltn`` shows it to every local user) reads, writes and fills it. A live run's store decides who
is in the run (``dead/{m}`` makes a member leave, ``dead_why/{m}`` gets it SIGKILLed), so it
must not be open. The options and why this one:

- A ``PrefixStore`` under a secret prefix hides the keys, but anyone may still write any other
  key, as large and as many as they like: it does not stop the growth.
- HMAC-signed values that readers verify stop forged verdicts, but not writes, growth, or a
  forger overwriting a real key (a denial of service), and every reader of every key (gloo's
  own, in C++) would have to verify.
- An authenticated server in front of the data: a client proves it knows the run's secret
  before the server reads a single request. A process that knows only the port can then neither
  read, write nor grow it: before the proof the server reads exactly one 64-byte answer, within
  :data:`HANDSHAKE_TIMEOUT_S`, from at most :data:`MAX_PENDING` connections at a time (a new
  one closes the oldest: a real client answers in milliseconds, a flood of idle connections
  cannot keep it out). This is what is done here.

The handshake is a mutual challenge-response with HMAC-SHA256 over both sides' random nonces
(the secret never crosses the wire; a recorded exchange cannot be replayed, and a client does not
talk to a server that cannot prove the secret either). Authenticated clients are bounded too: a
request over :data:`MAX_FRAME_BYTES` ends its connection, and the data held stays under
``max_bytes`` (a write beyond it is refused with one line). The traffic itself is not encrypted:
like gloo's and NCCL's own connections, it belongs on the job's private network.

The store semantics are ``TCPStore``'s (``get`` and ``wait`` block until the keys exist, up to a
timeout; ``add`` on decimal values; ``compare_set`` with an empty expected value creates the
key). One asyncio loop in a thread serves every connection, so blocked waits cost no thread and a
flood of idle connections costs a bounded number of sockets, not memory.

The secret reaches workers in their environment (``VARUNA_LIVE_STORE_KEY``, read through
:class:`varuna.core.env.WorkerSettings`), never on a command line: ``/proc/PID/environ`` is
readable by the process's owner only.

Example::

    >>> server = AuthStoreServer("127.0.0.1", key="00" * 32)  # doctest: +SKIP
    >>> client = AuthStore("127.0.0.1", server.port, key="00" * 32)  # doctest: +SKIP
    >>> client.set("a", "1"); client.add("a", 2)  # doctest: +SKIP
    3
    >>> server.close()  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import secrets
import socket
import struct
import threading
import time
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

__all__ = ["HANDSHAKE_TIMEOUT_S", "MAX_FRAME_BYTES", "MAX_PENDING", "AuthStore", "AuthStoreServer",
           "new_key"]

_MAGIC = b"VLS1"
_NONCE = 32
_MAC = 32
#: How long a new connection has to prove the secret before it is closed.
HANDSHAKE_TIMEOUT_S = 5.0
#: Connections still in their handshake at one time; a new one beyond closes the oldest.
MAX_PENDING = 128
#: Authenticated connections at one time (two per worker: its own and its heartbeat thread's).
MAX_CLIENTS = 8192
#: The largest request or answer (a transfer's metadata, the members' records).
MAX_FRAME_BYTES = 64 << 20
#: A connection's read buffer before the server stops reading from it (asyncio's flow control):
#: what a client that has not proven the secret can make the server hold, at most twice this.
_READ_LIMIT = 16 << 10
#: What one store holds at most by default (keys and values).
DEFAULT_MAX_BYTES = 1 << 30

_SET, _GET, _ADD, _CAS, _CHECK, _WAIT, _DELETE, _NUM_KEYS, _MULTI_GET, _MULTI_SET, _APPEND = range(11)
_OK, _TIMEOUT, _REFUSED = 0, 1, 2


def new_key() -> str:
    """A fresh per-run secret (64 hex digits).

    Example::

        >>> len(new_key())
        64
    """
    return secrets.token_hex(32)


def _secret(key: str) -> bytes:
    raw = key.strip()
    if len(raw) < 32:
        raise ValueError("the live store's key is too short (at least 32 characters; varuna-launch and "
                         "the manager make a 64-digit one per run)")
    return raw.encode()


def _mac(secret: bytes, who: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    message = b"varuna-live-store " + who + server_nonce + client_nonce
    return hmac.new(secret, message, hashlib.sha256).digest()


def _pack(op: int, parts: Sequence[bytes]) -> bytes:
    body = [struct.pack("!BH", op, len(parts))]
    for p in parts:
        body += [struct.pack("!I", len(p)), p]
    data = b"".join(body)
    return struct.pack("!I", len(data)) + data


def _unpack(data: bytes) -> tuple[int, list[bytes]]:
    op, n = struct.unpack_from("!BH", data)
    at, parts = 3, []
    for _ in range(n):
        (size,) = struct.unpack_from("!I", data, at)
        at += 4
        if at + size > len(data):
            raise ValueError("a truncated field")
        parts.append(data[at:at + size])
        at += size
    return op, parts


def _b(value: str | bytes | bytearray | Sequence[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class AuthStoreServer:
    """The store, served on ``host`` (a free port unless ``port``) to clients that prove ``key``
    (Note [Store authentication]). ``close()`` stops the loop thread and closes every socket.

    Example::

        >>> server = AuthStoreServer("127.0.0.1", key=new_key())  # doctest: +SKIP
        >>> server.address  # doctest: +SKIP
        '127.0.0.1:41234'
    """

    def __init__(self, host: str, *, key: str, port: int = 0, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._secret = _secret(key)
        self.max_bytes = max_bytes
        self._data: dict[str, bytes] = {}
        self._size = 0
        self._waiters: dict[str, list[asyncio.Future]] = {}
        self._written: dict[str, float] = {}  # key -> monotonic time of its last write
        self._pending: dict[asyncio.StreamWriter, None] = {}  # handshakes under way, oldest first
        self._clients = 0
        self._closing = False
        self._writers: set[asyncio.StreamWriter] = set()
        #: connections closed without the secret (a bad or no proof, or over MAX_PENDING)
        self.refused = 0
        self._loop = asyncio.new_event_loop()
        family, kind, proto, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(where)
            sock.listen(512)
            sock.setblocking(False)
            self.port = sock.getsockname()[1]
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._serve, sock=sock, limit=_READ_LIMIT))
        except BaseException:
            sock.close()
            self._loop.close()
            raise
        self.host = host
        self.address = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
        self._thread = threading.Thread(target=self._loop.run_forever, name="varuna-live-store", daemon=True)
        self._thread.start()

    # -- what the host asks directly ----------------------------------------------------------

    @property
    def stored_bytes(self) -> int:
        """Keys and values held now."""
        return self._size

    def peek(self, key: str) -> bytes | None:
        """``key``'s value now, None when unset (read from the host's own thread; no wait)."""
        return self._data.get(key)

    def last_write(self, key: str) -> float | None:
        """When ``key`` was last written (``time.monotonic()`` of this process), None: never."""
        return self._written.get(key)

    def close(self) -> None:
        """Stop serving: the listening socket and every connection close, the thread is joined."""
        if self._loop.is_closed():
            return

        async def stop() -> None:
            # Not task.cancel(): a cancelled connection task makes asyncio log a traceback. Closed
            # sockets and woken waits end every task on its own path instead.
            self._closing = True
            self._server.close()
            for waiting in self._waiters.values():
                for fut in waiting:
                    if not fut.done():
                        fut.set_result(None)
            for writer in list(self._writers):
                writer.transport.abort()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            await asyncio.wait(tasks, timeout=5.0) if tasks else None

        with contextlib.suppress(Exception):  # a loop already stopped: nothing left to close
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10.0)
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)
        if not self._thread.is_alive():
            self._loop.close()

    # -- the connections -----------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        admitted = False
        try:
            if len(self._pending) >= MAX_PENDING:
                # The oldest handshake goes, not the newest: a real client answers within
                # milliseconds, so a flood of idle connections cannot keep it out.
                oldest = next(iter(self._pending))
                del self._pending[oldest]
                oldest.transport.abort()
            admitted = await self._admit(reader, writer)
            if not admitted or self._clients >= MAX_CLIENTS:
                return
            self._clients += 1
            try:
                await self._requests(reader, writer)
            finally:
                self._clients -= 1
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, struct.error):
            pass  # a client gone or speaking garbage: its connection ends, nothing else
        finally:
            self.refused += not admitted
            self._writers.discard(writer)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        self._pending[writer] = None
        try:
            server_nonce = secrets.token_bytes(_NONCE)
            writer.write(_MAGIC + server_nonce)
            try:
                answer = await asyncio.wait_for(reader.readexactly(_NONCE + _MAC), HANDSHAKE_TIMEOUT_S)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError):
                return False
            client_nonce, proof = answer[:_NONCE], answer[_NONCE:]
            if not hmac.compare_digest(proof, _mac(self._secret, b"client", server_nonce, client_nonce)):
                return False
            writer.write(_mac(self._secret, b"server", server_nonce, client_nonce))
            await writer.drain()
            return True
        finally:
            self._pending.pop(writer, None)

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                (size,) = struct.unpack("!I", await reader.readexactly(4))
            except asyncio.IncompleteReadError:
                return  # the client closed
            if not 3 <= size <= MAX_FRAME_BYTES:
                return
            op, parts = _unpack(await reader.readexactly(size))
            status, answer = await self._do(op, parts)
            writer.write(_pack(status, answer))
            await writer.drain()

    # -- the store -----------------------------------------------------------------------------

    def _put(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``; :class:`_Refused` when that would pass ``max_bytes``."""
        old = self._data.get(key)
        grown = len(value) - (len(old) if old is not None else -len(key.encode()))
        if grown > 0 and self._size + grown > self.max_bytes:
            raise _Refused(f"the live store is full ({self._size} of {self.max_bytes} bytes); a write of "
                           f"{len(value)} bytes to {key[:80]!r} is refused")
        self._data[key] = value
        self._size += grown
        self._written[key] = time.monotonic()
        for fut in self._waiters.pop(key, []):
            if not fut.done():
                fut.set_result(None)

    async def _present(self, keys: list[str], timeout_ms: int) -> bool:
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            missing = [k for k in keys if k not in self._data]
            if not missing:
                return True
            left = deadline - time.monotonic()
            if left <= 0 or self._closing:
                return False
            fut = self._loop.create_future()
            for k in missing:
                self._waiters.setdefault(k, []).append(fut)
            try:
                await asyncio.wait_for(fut, left)
            except asyncio.TimeoutError:
                pass
            finally:
                for k in missing:
                    waiting = self._waiters.get(k)
                    if waiting is not None and fut in waiting:
                        waiting.remove(fut)
                        if not waiting:
                            del self._waiters[k]

    async def _do(self, op: int, parts: list[bytes]) -> tuple[int, list[bytes]]:
        data = self._data
        if op in (_GET, _MULTI_GET, _WAIT):
            keys = [p.decode() for p in parts[1:]]
            if not await self._present(keys, int(parts[0])):
                return _TIMEOUT, []
            return _OK, ([] if op == _WAIT else [data[k] for k in keys])
        if op == _CHECK:
            return _OK, [b"1" if all(p.decode() in data for p in parts) else b"0"]
        if op == _NUM_KEYS:
            return _OK, [str(len(data)).encode()]
        if op == _DELETE:
            key = parts[0].decode()
            old = data.pop(key, None)
            if old is not None:
                self._size -= len(key.encode()) + len(old)
            return _OK, [b"1" if old is not None else b"0"]
        try:
            return _OK, self._write(op, parts)
        except _Refused as why:
            return _REFUSED, [str(why).encode()]

    def _write(self, op: int, parts: list[bytes]) -> list[bytes]:
        """The requests that store something; :class:`_Refused` when the store is full."""
        data = self._data
        if op == _MULTI_SET:
            half = len(parts) // 2
            for k, v in zip(parts[:half], parts[half:]):
                self._put(k.decode(), v)
            return []
        key = parts[0].decode()
        if op in (_SET, _APPEND):
            self._put(key, data.get(key, b"") + parts[1] if op == _APPEND else parts[1])
            return []
        if op == _ADD:
            try:
                total = int(data.get(key, b"0")) + int(parts[1])
            except ValueError:
                raise _Refused(f"add on {key!r}, which does not hold an integer") from None
            self._put(key, str(total).encode())
            return [str(total).encode()]
        if op == _CAS:  # TCPStore's compareSet, to the letter
            expected, desired = parts[1], parts[2]
            current = data.get(key)
            if current is None and expected:
                return [expected]
            if current is None or current == expected:
                self._put(key, desired)
            return [data[key]]
        raise _Refused(f"unknown request {op}")


class _Refused(Exception):
    """A request the server answers with a refusal (the store is full, a bad request)."""


class AuthStore(dist.Store):
    """A client of :class:`AuthStoreServer`: a ``torch.distributed.Store`` (gloo groups, through
    ``PrefixStore``, rendezvous on it). Thread-safe: calls from several threads take turns on the
    one connection (a thread that must not wait behind another's blocking ``wait`` gets its own
    client, as the live watch does). A failed connection fails every later call
    (``DistNetworkError``); a wait that runs out raises ``DistStoreError``.

    Example::

        >>> key = os.environ["VARUNA_LIVE_STORE_KEY"]  # doctest: +SKIP
        >>> store = AuthStore("10.0.0.4", 29400, key=key)  # doctest: +SKIP
        >>> store.set("k", b"v"); store.get("k")  # doctest: +SKIP
        b'v'
    """

    def __init__(self, host: str, port: int, *, key: str,
                 timeout: timedelta = timedelta(seconds=300)) -> None:
        super().__init__()
        self.set_timeout(timeout)
        secret = _secret(key)
        self._where = f"{host}:{port}"
        self._lock = threading.Lock()
        self._broken: str | None = None
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            try:
                left = max(1.0, deadline - time.monotonic())
                self._sock = socket.create_connection((host, port), timeout=left)
                break
            except ConnectionRefusedError:
                if time.monotonic() >= deadline:
                    raise dist.DistNetworkError(
                        f"the live store at {self._where} refuses connections") from None
                time.sleep(0.1)  # the server may still be starting: retry until the timeout
            except OSError as exc:
                raise dist.DistNetworkError(f"cannot reach the live store at {self._where}: {exc}") from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self._sock.settimeout(HANDSHAKE_TIMEOUT_S * 2)
            hello = self._recv(len(_MAGIC) + _NONCE)
            if hello[:len(_MAGIC)] != _MAGIC:
                raise dist.DistNetworkError(f"{self._where} is not a varuna live store")
            server_nonce, client_nonce = hello[len(_MAGIC):], secrets.token_bytes(_NONCE)
            self._sock.sendall(client_nonce + _mac(secret, b"client", server_nonce, client_nonce))
            proof = self._recv(_MAC)
            if not hmac.compare_digest(proof, _mac(secret, b"server", server_nonce, client_nonce)):
                raise dist.DistNetworkError(f"the live store at {self._where} did not prove the run's key")
        except (OSError, dist.DistNetworkError) as exc:
            self._sock.close()
            if isinstance(exc, dist.DistNetworkError):
                raise
            raise dist.DistNetworkError(f"the live store at {self._where} refused this process's key "
                                        f"(a wrong $VARUNA_LIVE_STORE_KEY?): {exc}") from None

    # -- the wire ------------------------------------------------------------------------------

    def _recv(self, n: int) -> bytes:
        chunks, left = [], n
        while left:
            chunk = self._sock.recv(min(left, 1 << 20))
            if not chunk:
                raise ConnectionResetError("the live store closed the connection")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _call(self, op: int, parts: Sequence[bytes], wait_s: float = 0.0) -> list[bytes]:
        frame = _pack(op, parts)
        if len(frame) > MAX_FRAME_BYTES:
            raise ValueError(f"a live-store request of {len(frame)} bytes (at most {MAX_FRAME_BYTES})")
        with self._lock:
            if self._broken is not None:
                raise dist.DistNetworkError(self._broken)
            try:
                self._sock.settimeout(wait_s + self.timeout.total_seconds())
                self._sock.sendall(frame)
                (size,) = struct.unpack("!I", self._recv(4))
                if not 3 <= size <= MAX_FRAME_BYTES:
                    raise ConnectionResetError(f"a malformed answer ({size} bytes)")
                status, answer = _unpack(self._recv(size))
            except (OSError, struct.error, ValueError) as exc:
                self._broken = f"the connection to the live store at {self._where} failed: {exc}"
                with contextlib.suppress(OSError):
                    self._sock.close()
                raise dist.DistNetworkError(self._broken) from None
        if status == _TIMEOUT:
            raise dist.DistStoreError(f"waited {wait_s:g}s for keys of the live store at {self._where}")
        if status == _REFUSED:
            raise dist.DistStoreError(answer[0].decode() if answer else "refused")
        return answer

    def _wait_ms(self, timeout: timedelta | None) -> tuple[bytes, float]:
        seconds = (timeout if timeout is not None else self.timeout).total_seconds()
        return str(int(seconds * 1000)).encode(), seconds

    # -- the Store API -------------------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:  # type: ignore[override]
        self._call(_SET, [_b(key), _b(value)])

    def get(self, key: str) -> bytes:  # type: ignore[override]
        ms, s = self._wait_ms(None)
        return self._call(_GET, [ms, _b(key)], s)[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:  # type: ignore[override]
        ms, s = self._wait_ms(None)
        return self._call(_MULTI_GET, [ms, *map(_b, keys)], s)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:  # type: ignore[override]
        self._call(_MULTI_SET, [*map(_b, keys), *map(_b, values)])

    def append(self, key: str, value: str | bytes) -> None:  # type: ignore[override]
        self._call(_APPEND, [_b(key), _b(value)])

    def add(self, key: str, amount: int) -> int:  # type: ignore[override]
        return int(self._call(_ADD, [_b(key), str(int(amount)).encode()])[0])

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:  # type: ignore[override]
        return self._call(_CAS, [_b(key), _b(expected), _b(desired)])[0]

    def check(self, keys: list[str]) -> bool:  # type: ignore[override]
        return self._call(_CHECK, list(map(_b, keys)))[0] == b"1"

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:  # type: ignore[override]
        ms, s = self._wait_ms(timeout)
        self._call(_WAIT, [ms, *map(_b, keys)], s)

    def delete_key(self, key: str) -> bool:  # type: ignore[override]
        return self._call(_DELETE, [_b(key)])[0] == b"1"

    def num_keys(self) -> int:  # type: ignore[override]
        return int(self._call(_NUM_KEYS, [])[0])

    def close(self) -> None:
        """Close the connection (later calls fail)."""
        with self._lock:
            self._broken = self._broken or "the live-store client was closed"
            with contextlib.suppress(OSError):
                self._sock.close()
