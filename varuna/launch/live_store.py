"""The rendezvous store of a live-morph job (``varuna-launch --live-morph``), hosted by the
launcher so that it outlives every worker (docs/live_morph.md, Protocol): workers join it as
clients (``$VARUNA_LIVE_STORE``, proving the run's secret ``$VARUNA_LIVE_STORE_KEY``), and the
supervisor writes there that a worker is dead when it sees the exit, so the survivors stop
waiting for it at once.

Example::

    >>> with LiveStore() as store:  # doctest: +SKIP
    ...     env = store.worker_env()  # VARUNA_LIVE_STORE and VARUNA_LIVE_STORE_KEY
    ...     store.declare_dead(3)
"""

from __future__ import annotations

from datetime import timedelta
from types import TracebackType
from typing import Any

__all__ = ["FROZEN_CONFIRM_S", "LIVE_JOIN_ENV", "LIVE_NOTICE_ENV", "LIVE_STORE_ENV", "LIVE_STORE_KEY_ENV",
           "RESTARTS_ENV", "LiveStore"]

#: Where workers find the store (``varuna.runtime.live_morph.LIVE_STORE_ENV``).
LIVE_STORE_ENV = "VARUNA_LIVE_STORE"
#: The run's secret for the store (Note [Store authentication] in varuna/runtime/auth_store.py):
#: in the workers' environment only, never on a command line.
LIVE_STORE_KEY_ENV = "VARUNA_LIVE_STORE_KEY"
#: Set to ``1`` for a worker added to a running job (growth; ``varuna.runtime.live_morph.LIVE_JOIN_ENV``).
LIVE_JOIN_ENV = "VARUNA_LIVE_JOIN"
#: The signal (a name, e.g. ``SIGUSR2``) by which a supervisor tells one worker that its VM goes
#: away soon: hand over and leave (``LiveTrainer(notice_signals=...)``). Set by ``varuna-manager``,
#: whose SIGUSR1 stays the graceful stop of the whole job.
LIVE_NOTICE_ENV = "VARUNA_LIVE_NOTICE_SIGNAL"
#: How many times the launcher restarted the job from a checkpoint (0 on the first launch).
RESTARTS_ENV = "VARUNA_RESTARTS"


#: How long the store must have seen no heartbeat from a member declared frozen before the
#: launcher (or the manager) kills it (Note [Verdict check]).
FROZEN_CONFIRM_S = 3.0


class LiveStore:
    """The run's authenticated store (``varuna.runtime.auth_store``, Note [Store authentication])
    on ``host`` (a free port), for one launch of the job, with a fresh secret (``key``) that the
    workers get in ``$VARUNA_LIVE_STORE_KEY``; a process that knows only the port can neither
    read, write nor grow it.

    Note [Verdict check]: the watches' word that a member is frozen (``dead_why/{m}``) is checked
    against the store's own view before the member is killed: the store knows when it last
    received that member's heartbeat. One within :data:`FROZEN_CONFIRM_S` means the process
    runs; it finds its own verdict at its next beat and leaves by itself (exit 76), so it is not
    killed. Only a member the store too has not heard from is.

    Example::

        >>> store = LiveStore(); store.address.startswith("127.0.0.1:")  # doctest: +SKIP
        True
        >>> env = {LIVE_STORE_ENV: store.address, LIVE_STORE_KEY_ENV: store.key}  # doctest: +SKIP
        >>> store.close()  # doctest: +SKIP
    """

    def __init__(self, host: str = "127.0.0.1", timeout_s: float = 60.0, *,
                 max_bytes: int | None = None) -> None:
        # torch only for live-morph jobs: the plain launcher starts without loading it.
        from varuna.runtime.auth_store import DEFAULT_MAX_BYTES, AuthStoreServer, new_key

        self.key = new_key()
        self._server: Any = AuthStoreServer(host, key=self.key,
                                            max_bytes=DEFAULT_MAX_BYTES if max_bytes is None else max_bytes)
        self._timeout_s = timeout_s
        self._client: Any = None
        self.address = self._server.address

    @property
    def store(self) -> Any:
        """A client of the store for this process (a ``torch.distributed.Store``)."""
        if self._server is None:
            raise RuntimeError("the live store is closed")
        if self._client is None:
            from varuna.runtime.auth_store import AuthStore

            self._client = AuthStore(self._server.host, self._server.port, key=self.key,
                                     timeout=timedelta(seconds=self._timeout_s))
        return self._client

    @property
    def server(self) -> Any:
        """The :class:`varuna.runtime.auth_store.AuthStoreServer` (how much it holds, refusals)."""
        return self._server

    def worker_env(self) -> dict[str, str]:
        """What a worker needs to reach the store: its address and the run's key."""
        return {LIVE_STORE_ENV: self.address, LIVE_STORE_KEY_ENV: self.key}

    def declare_dead(self, rank: int) -> None:
        """Tell the survivors that worker ``rank`` (its live-morph member id) is gone."""
        from varuna.runtime.live_morph import declare_dead

        declare_dead(self.store, rank)

    def frozen(self, rank: int) -> str | None:
        """Why the workers declared ``rank`` dead while its process may still run (no heartbeat:
        frozen or hung), else None (Note [Live watch] in varuna/runtime/live_watch.py) -- also
        None while the store itself still hears its heartbeat (Note [Verdict check])."""
        import time

        server = self._server
        if server is None:
            return None
        why = server.peek(f"varuna/live/dead_why/{rank}")
        if why is None:
            return None
        beat = server.last_write(f"varuna/live/beat/{rank}")
        if beat is not None and time.monotonic() - beat < FROZEN_CONFIRM_S:
            return None
        return why.decode(errors="replace")

    def joined(self, rank: int) -> bool:
        """Whether member ``rank`` ever joined the live run (the store received its heartbeat)."""
        server = self._server
        return server is not None and server.last_write(f"varuna/live/beat/{rank}") is not None

    def close(self) -> None:
        """Stop serving: the listening socket and every connection close."""
        client, server, self._client, self._server = self._client, self._server, None, None
        if client is not None:
            client.close()
        if server is not None:
            server.close()

    def __enter__(self) -> LiveStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
